"""The reader stages (lines, parse, transform, balance, records, shuffle, batch), their state
and the pipeline that chains them."""
