"""``python -m train heads=<ctc|falcon|adadecode> [key=value ...]``: train a draft head on the cache.

Examples::

    python -m train heads=ctc train.max_steps=2000 train.optimizer.lr=3e-4
    python -m train heads=falcon train.logger=csv train.run_name=falcon-k2

Writes ``<output_root>/runs/<head>/<run_name>/`` (see :mod:`train.run`); exit status 2 on a bad
config key or value.
"""
from train.run import main

if __name__ == "__main__":
    main()
