"""engine/data"""
