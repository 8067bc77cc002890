"""The domain at the top of `sessions/`: events, the state machine, the recorder, validation, names."""
