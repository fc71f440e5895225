"""Fast, in-process tests of one component each (``make test-fast``)."""
