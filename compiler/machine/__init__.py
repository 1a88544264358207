"""This machine and process: what a graph needs of the machine, the torch versions served."""
