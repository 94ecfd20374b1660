"""engine/checkpoint"""
