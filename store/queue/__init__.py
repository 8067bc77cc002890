"""The durable queue: consumers' claims, acks and leases on the projector's queue rows. Import
from the modules below."""
