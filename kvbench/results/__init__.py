"""What a run leaves on disk: the row schema (``schema``), the cell's files (``writer``), where numbers came
from (``provenance``)."""
