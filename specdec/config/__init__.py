"""Settings declared once (settings) and the ones both model services share (services)."""
