"""Export of a trained run as one ordinary model directory, written atomically, and its validation and publishing."""
