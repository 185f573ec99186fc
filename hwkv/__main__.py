"""`python -m hwkv`: the `hwkv` command (hwkv_entry.main; here hwkv's own import, torch's, has already run)."""
import sys

from hwkv_entry import main

if __name__ == "__main__":
    sys.exit(main())
