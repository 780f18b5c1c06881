"""The version of hf_dp (one place: the package, the card and the build read it)."""

__version__ = "0.1.0"
