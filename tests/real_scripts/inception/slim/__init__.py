"""Stand-in for ``inception/slim`` (the slim bundled with Inception, not tf_slim)."""
