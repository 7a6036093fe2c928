"""``python -m train heads=<name> [key=value ...]``: train a draft head (usage: :data:`train.run.USAGE`)."""
from train.run import main

if __name__ == "__main__":
    main()
