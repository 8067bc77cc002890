"""The store: the append path, migrations, the driver-level writes, query plans, faults."""
