"""callgate shared plumbing: record types, topics, Avro codec, Kafka wiring, settings, logging, CLI."""

__version__ = "0.1.0"
