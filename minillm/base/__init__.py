"""What every part stands on: atomic JSON files and the one-line errors every command promises."""
