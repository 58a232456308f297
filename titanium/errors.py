"""The one base class for mistakes in what the user gave us (config, data, checkpoint, tokenizer).

The entry point reports these as a single message without a traceback; anything else is a bug and
keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user; the message names the file/key/row and the fix."""
