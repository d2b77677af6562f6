"""`python -m service.cli`: the `optdrift` command from a plain copy of the tree."""

from service.cli.main import app

app()
