"""The public Python API: Model and load, prefix and resume handles, text generation, introspection."""
