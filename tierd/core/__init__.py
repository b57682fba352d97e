"""The request core: requests taken in order, handled, their copies run, answered."""
