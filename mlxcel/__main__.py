"""`python -m mlxcel`."""

from mlxcel.cli import main

if __name__ == "__main__":
    main()
