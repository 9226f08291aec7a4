"""The reference runtime's `tools/tinyloop_add_sign_bit.py` path: runs `tinyloop-add-sign-bit` with the same arguments.

PYTHONPATH=src python tools/tinyloop_add_sign_bit.py --from-pt CKPT --loop-only [--frac-bits {1,4}] -i IN -o OUT
"""

from __future__ import annotations

from tinyloop.cli.add_sign_bit import main

if __name__ == "__main__":
    raise SystemExit(main())
