"""The read side: immutable snapshots of an experiment, the same from a live coordinator and
from a finished experiment's store (``model``), and its paged and charted reads (``pages``)."""
