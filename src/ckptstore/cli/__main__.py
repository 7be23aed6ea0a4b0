"""``python -m ckptstore.cli``: the ``ckptstore`` command without its console script."""

from ckptstore.cli.main import main

main()
