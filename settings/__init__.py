"""The typed-config machinery config.py stands on: YAML to typed dataclasses, overrides, the
one-line ConfigError (typed_config.py); the checks across fields load_config runs (checks.py)."""
