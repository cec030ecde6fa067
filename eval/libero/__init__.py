"""LIBERO evaluation (RLinf style): B environments, one B-row request per chunk; see docs/libero.md."""
