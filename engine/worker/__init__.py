"""Worker side of the engine: block tables, the persistent input batch, the model runner."""
