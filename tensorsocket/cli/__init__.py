"""The command line: ``tensorsocket status | top | clean | config`` (main)."""
