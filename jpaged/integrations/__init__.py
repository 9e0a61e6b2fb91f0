"""Adapters that let other libraries drive jpaged; each imports its library, jpaged never does."""
