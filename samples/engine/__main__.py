"""`python samples/engine serve ...` or `python -m samples.engine serve ...`: same as serve.py."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serve  # noqa: E402

if __name__ == "__main__":
    serve.main()
