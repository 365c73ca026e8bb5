"""Entry point for ``python -m ckptctl``."""

from ckptctl.cli.main import main

if __name__ == "__main__":
    main()
