"""Flower's client side of fedlora: the ClientApp (fedlora.clients.app) and a client's round (fedlora.clients.rounds);
the math they call is in ``fedlora``."""
