"""The HTTP shell: an OpenAI-compatible server on the Engine (`fx-engine serve`)."""
