"""Kademlia DHT records for meshd: signed capability records and their validator."""
