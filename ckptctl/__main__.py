"""Entry point for ``python -m ckptctl``."""

from ckptctl.cli.launch import main

if __name__ == "__main__":
    main()
