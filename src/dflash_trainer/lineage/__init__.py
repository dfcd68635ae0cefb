"""What a drafter was trained on, continuation by continuation (lineage.json)."""
