"""Configuration: schemas, the ConfigStore, validation and hashing."""
