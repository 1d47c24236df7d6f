"""The datasets a user builds: StreamingJsonl, Mix, PackTokens; checks of how they are called."""
