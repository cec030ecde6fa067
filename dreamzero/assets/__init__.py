"""Data files shipped with the package (metadata.json with SYNTHETIC statistics for the embedded tiny model)."""
