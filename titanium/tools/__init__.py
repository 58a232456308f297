"""Command-line tools that are not the training loop: dry run, (later) conversion and generation."""
