"""streamer: event-sourced streaming RL training of language models over Redis streams."""

__version__ = "0.1.0"
