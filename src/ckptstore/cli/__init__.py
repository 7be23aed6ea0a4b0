"""The command-line face of ckptstore: the ``ckptstore`` command and its demo.

Kept apart from the library so that nothing under ``ckptstore`` imports click or the demo's
training job; this package may import the library and ``ckptstore.testing``, never the reverse.
"""

from ckptstore.cli.main import main

__all__ = ["main"]
