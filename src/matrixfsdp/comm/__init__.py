"""Collectives: the protocol both front-ends issue their reductions and gathers through, with
byte counting, chosen per tensor device."""
