"""A stand-in for PyPI's `expecttest` (not packaged in Debian 12), which torch's common_utils
imports; the distributed test cases this suite runs use none of it beyond these names."""
import unittest

ACCEPT = False


class TestCase(unittest.TestCase):
    longMessage = True

    def assertExpectedInline(self, actual, expect, skip=0):
        self.assertEqual(str(actual).strip(), str(expect).strip())
