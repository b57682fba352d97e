"""The daemon as a whole: its main loop, how it is assembled, its status and warm restart."""
