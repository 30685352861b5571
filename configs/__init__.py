"""DreamGym's shipped presets, installed as package data (see infra/presets.py)."""
