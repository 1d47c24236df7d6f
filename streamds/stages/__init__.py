"""The stages and their state: the reader chain (lines, parse, transform, balance, records,
shuffle, batch) and the pipeline that chains them; beside it the stages built on readers
(mixing, packing, pools, rebatch). Every stage has `reset(state)`, iteration and `get_state()`
and owns its keys; `state` holds the one format version of the whole state tree."""
