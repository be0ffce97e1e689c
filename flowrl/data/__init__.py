"""Prompt datasets written by `flowrl data` (for example OCR prompts with their target text)."""
