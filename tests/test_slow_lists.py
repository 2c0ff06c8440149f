"""conftest's SLOW_CASES / SLOW_TESTS name tests that exist: a renamed test must not slip back into the default suite unseen."""
import os
import re

import conftest

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_every_listed_slow_test_exists():
  missing = []
  for entry in conftest.SLOW_CASES + conftest.SLOW_TESTS:
    fname, test = entry.split("::")
    with open(os.path.join(TESTS, fname)) as f:
      source = f.read()
    if not re.search(rf"^def {re.escape(test.split('[')[0])}\(", source, re.M):
      missing.append(entry)
  assert not missing, f"tests/conftest.py lists tests that no longer exist: {missing}"
