"""The edge: the sockets and framing requests arrive on (ZMTP, the lookup channel, the
descriptor inbox, the endpoint's lock) and the operators' HTTP."""
