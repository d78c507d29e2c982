"""The project's base: its user-error type (errors) and the atomic writes every output goes through (staging)."""
