"""draftloop: one retryable run for a full EAGLE-3 drafter cycle."""

__version__ = "0.1.0"
