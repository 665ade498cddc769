"""What a simulator outside Ray embeds to train with a run (`env: external`): numpy and msgpack only (docs/external.md)."""

from rlplatform.client.simulator import ExternalClient

__all__ = ["ExternalClient"]
