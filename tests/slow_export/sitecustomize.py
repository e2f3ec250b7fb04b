"""On PYTHONPATH in tests/test_trainer.py's slow-export test: rank 0's artifact write first sleeps
SMELT_TEST_EXPORT_DELAY seconds, a stand-in for an 8B export that outlasts the training timeout while the
other ranks wait for it."""
import os
import time

_delay = float(os.environ.get("SMELT_TEST_EXPORT_DELAY", "0"))
if _delay:
    import train.export as _export

    _write = _export.write_artifact

    def _slow_write(*args, **kwargs):
        time.sleep(_delay)
        return _write(*args, **kwargs)

    _export.write_artifact = _slow_write
