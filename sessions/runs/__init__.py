"""What belongs to a run as a whole, not to one session: its configuration digest, recorded in the
run's own stream (`fingerprint`), and the sweep that fails the sessions a dead process left open
(`recovery`). Import from the modules."""
